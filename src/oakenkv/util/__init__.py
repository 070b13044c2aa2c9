"""Small shared helpers: paths and atomic writes, memory checks."""
