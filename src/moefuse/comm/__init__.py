"""moefuse.comm (being built)."""

__all__: list[str] = []
