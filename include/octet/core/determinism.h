// The determinism policy (DESIGN.md rule 3): once requested, every op runs a deterministic path
// or throws an error that names the remedy.
#pragma once

namespace octet {

/// True when determinism is requested by either the API setter or env OCTET_DETERMINISTIC
/// (any value other than empty or "0"). Either source is enough; neither can veto the other.
bool deterministic();
/// Requests (or stops requesting, through the API) deterministic execution.
void set_deterministic(bool on);

/// Throws octet::Error naming `op` and `remedy` when determinism is requested; for paths that
/// have no deterministic implementation.
void check_deterministic_supported(const char* op, const char* remedy);

}  // namespace octet
