"""The operator's controllers. Importing this package registers the kopf handlers, so that
``kopf run -m arl_tangram.controllers`` and ``tangram operator`` run the same operator."""

from arl_tangram.controllers import handlers as handlers
