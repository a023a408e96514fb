"""infergraft core: hook contract, plugin manager, build(), Engine."""
