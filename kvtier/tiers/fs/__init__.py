"""The filesystem tier: one chunk per file under a shared directory tree."""
