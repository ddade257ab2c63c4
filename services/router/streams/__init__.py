"""Generations in flight: the shared GenerateMany stream per replica, relay with failover, the replay buffer."""
