"""Scale-out: process groups and collectives, executors, data-parallel replicas, the wire format."""
