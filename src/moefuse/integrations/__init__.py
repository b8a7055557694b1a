"""Integrations of moefuse into other libraries. Each submodule imports its library lazily (the
libraries are optional extras: ``pip install moefuse[transformers]``), so importing this package
never needs them."""
