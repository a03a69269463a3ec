"""unisleep drivers, one per platform (installed as unisleep.backends)."""
