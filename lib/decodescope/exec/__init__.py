"""Layer 5, exec: processes, locks, the host seam (local or ssh, one protocol), the server lifecycle, the
host inventory. decodescope.probes, the programs that run on the host, sit in this layer too."""
