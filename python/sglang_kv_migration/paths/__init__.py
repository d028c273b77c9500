"""The data paths behind one interface (`base.DataPath`): `host/` (host pool -> host pool
through Mooncake) and `device/` (into the target's GPU through CUDA IPC, from the
source's GPU or pinned host pool). Paths import nothing from `server/`."""
