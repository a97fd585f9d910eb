"""Analysis of finished runs: reports, figures, the papers' numbers, the settings reference.

Reads run directories and the settings declarations; nothing of the apps imports it.
"""
