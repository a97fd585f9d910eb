"""The Flower ServerApp."""
