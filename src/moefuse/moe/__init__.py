"""moefuse.moe (being built)."""

__all__: list[str] = []
