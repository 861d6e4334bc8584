"""The operator's HTTP gateway: the native action API, SandboxFusion's ``/run_code`` and the reward
shapes trainers call, in front of the one queue (:class:`~arl_tangram.domain.actions.ActionService`)."""

from arl_tangram.gateway.app import build_gateway_app
from arl_tangram.gateway.auth import Authenticator, KubernetesAuthenticator, Principal
from arl_tangram.gateway.config import GatewayConfig
from arl_tangram.gateway.state import BatchResults, Leadership

__all__ = [
    "Authenticator",
    "BatchResults",
    "GatewayConfig",
    "KubernetesAuthenticator",
    "Leadership",
    "Principal",
    "build_gateway_app",
]
