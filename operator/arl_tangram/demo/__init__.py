"""The real demo: a HumanEval rollout run pod-per-trajectory and with ARL-Tangram, side by side."""
