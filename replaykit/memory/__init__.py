"""Static buffers and who may still hold them: layout of static copies, copy-out of live
gradients and outputs, the hold over a pending backward, re-entry, shared memory pools."""
