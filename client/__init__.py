"""rdzv_client: the client of rdzv-server (placeholder until the client lands)."""
