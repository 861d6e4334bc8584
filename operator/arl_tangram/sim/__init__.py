"""Deterministic discrete-event simulator driving the real scheduler, managers and planner (pure)."""
