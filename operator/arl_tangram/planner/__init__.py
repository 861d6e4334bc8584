"""Periodic capacity planning: how many sandbox hosts and reward replicas, and where (pure)."""
