from typing import Any

TokensPrompt = dict[str, Any]
