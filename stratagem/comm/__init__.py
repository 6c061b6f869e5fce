"""How bytes move: in-process cross-device ops and the replica rendezvous."""
