"""A whole step across ranks: the route every rank agrees on (:mod:`.ranks`), DDP's gradient
reduction run between a step's two graphs (:mod:`.reduction`), and the watchdog that names a
rank stuck in a collective (:mod:`.watchdog`)."""
