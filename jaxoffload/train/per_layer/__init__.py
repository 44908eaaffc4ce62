"""The step a program per piece of the model (``train.per_layer_step``): its programs
(``pieces``), the driver that overlaps the host kernel's update with the next forward
pass (``overlap``), what it moves between programs (``moved``), its weight-offloaded
layers (``offloaded_layers``) and what it holds on the device (``footprint``).
"""
