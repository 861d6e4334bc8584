"""Capacity state and placement per resource type, each exposing its DP operator (pure)."""
