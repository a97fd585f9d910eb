"""The composition root: ``fedmm`` runs both apps of this project on Flower's simulation engine.

Nothing imports this package; it imports everything below it.
"""
