"""Bridges to other tools' ecosystems, each in its own subpackage and each an optional dependency: importing
`rope_patch` imports none of them."""
