"""The embedded mode: ``tangram up`` runs the operator's parts on one machine, with no cluster."""
