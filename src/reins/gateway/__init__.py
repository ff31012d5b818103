"""The API Gateway: durable rollouts, events and models, and the LLM proxy for harnesses."""

from reins.gateway.app import create_app
from reins.gateway.settings import GatewaySettings

__all__ = ["GatewaySettings", "create_app"]
