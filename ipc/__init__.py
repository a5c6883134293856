"""Wire layer shared by every Loom process: config, messages, codec, sockets, client."""
