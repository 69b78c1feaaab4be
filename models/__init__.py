"""Models: encoders (vit, bert), shared objectives, momentum/queues, weight loading, one class per task.

Import the submodules directly (e.g. `from models.pretrain import ALBEF_Base`); this package file
stays empty so that importing one part does not pull in the others.
"""
