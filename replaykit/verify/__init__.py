"""Whether a recording is what eager does: the recording call's probe and side effects, the
snapshot it restores, the bitwise comparison, the shadow check."""
