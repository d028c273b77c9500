"""What runs inside SGLang's processes: the plugin's hooks, flags, HTTP routes, the
tokenizer-side communicators and every rank's scheduler side. Nothing outside this
folder imports it, except SGLang itself through the plugin entry point."""
