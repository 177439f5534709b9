"""One router per resource: health, traces, plans, measurements, jobs."""
