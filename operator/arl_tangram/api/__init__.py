"""Custom resource models (pure: no kopf, kubernetes or aiohttp). Source of the CRD schemas."""
