"""Memory: sizing a request (plan), the residency policy, the loader, its arenas, reads and packed copies."""
