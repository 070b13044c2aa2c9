"""What the commands run: demo, generate, diagnose, info."""
