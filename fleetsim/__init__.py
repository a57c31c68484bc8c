"""The reference engine (an SGLang-compatible engine model and HTTP server), the fleet
simulator, workloads and reports: everything Weir is measured against."""
