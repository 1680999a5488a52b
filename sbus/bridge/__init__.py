"""``sbus bridge``: the local bus joined to an MQTT broker (docs/bridge.md).

`topics` translates keys and patterns to MQTT topics and filters, `core` decides what
crosses, marks and counts it (both pure); `shell` is the I/O around them (one bus
connection, one paho-mqtt connection, one select loop); `cli` parses the command line.
"""
