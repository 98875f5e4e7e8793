"""A decode step's cache write counters, every layer's, advanced by one kernel."""
