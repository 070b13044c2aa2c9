"""Where models, texts and tasks come from (installed packages, local files, the hub when allowed)."""
