"""How many requests run and wait (admission control, deadlines) and what the gateway observes of each model's
traffic for the autoscaler."""
