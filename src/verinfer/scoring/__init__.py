"""Token-DiFR scoring: replay each trace with one prefill and score every claimed token; score files."""
