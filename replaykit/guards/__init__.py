"""What a recording bakes in and checks on every call: module state, the optimizer's host values,
storages and hooks, input signatures, what code reads, host reads of the inputs."""
