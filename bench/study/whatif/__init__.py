"""`commbench whatif`: scenario.py (what the user plans), engine.py (traffic priced on
the network model), report.py (tables, figure, a measured run's own what-if)."""
