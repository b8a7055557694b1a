"""Compatibility layers mapping other libraries' names and call styles onto moefuse."""
