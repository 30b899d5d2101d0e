"""Adapters that put kvtier inside other serving engines (each imports its engine on demand)."""
