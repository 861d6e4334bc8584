"""The reward runtime: the process in reward pods that hosts several services on one GPU chunk."""

# How long a reward request is waited for by default: the dispatcher's wait for a replica's answer
# (an action without a timeout of its own), and a runtime's for one scoring call to its server
# (``--score-timeout``). Past it the caller has given up, so a scoring call that hangs longer only
# holds the device, and every other service's requests behind it. Restore and evict calls keep a
# longer one (a vLLM wake-up of big weights). Here, not in ``backends``, so that the dispatcher
# takes it without importing the runtime.
SCORE_TIMEOUT_S = 300.0
