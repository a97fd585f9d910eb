"""The Flower ClientApp and the local objectives."""
