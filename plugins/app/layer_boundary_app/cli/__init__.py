"""``layer-boundary run``: its entry point (``commands``), argparse types (``args``) and the run (``run``)."""
