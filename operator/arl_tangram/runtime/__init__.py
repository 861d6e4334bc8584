"""Making decisions real: the runtime interface and its backends (Kubernetes pods, local processes).

:mod:`.interface` is what the controllers call; :mod:`.pods` builds host pods (pure);
:mod:`.kubernetes` creates and deletes them through the API server.
"""
