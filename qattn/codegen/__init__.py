"""What to build (KernelSpec), in which operand format (recipes), and its source (render)."""
