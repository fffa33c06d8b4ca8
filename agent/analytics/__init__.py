"""PySpark jobs over spilled data (central machine only)."""
