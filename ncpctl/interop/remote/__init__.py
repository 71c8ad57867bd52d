"""Self-contained HF modeling code copied into exported ConceptLM directories.

These files must import nothing from ncpctl: they run where ncpctl is not installed
(``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)``).
"""
