"""ARL-Tangram: action-level orchestration of the external resources of agentic RL."""

__version__ = "0.1.0"

API_GROUP = "tangram.arl.dev"
API_VERSION = "v1alpha1"
