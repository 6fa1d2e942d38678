"""griffe extension: module-level tuple assignments (``A, B = 1, 2``) become attributes ``A`` and ``B``.

griffe's static visitor records ``A = 1`` but not ``A, B = 1, 2``, so such a name listed in an
``__all__`` (``ftlib.kernels.augment_ref.PHILOX_M0``) would have no entry in the reference, and a
package re-exporting it an alias that never resolves. Only the plain case is read: names on the
left, as many values on the right; anything else is left as griffe sees it.
"""

from __future__ import annotations

import ast

import griffe


class TupleAssignments(griffe.Extension):
    def on_module_members(self, *, node, mod, agent, **kwargs) -> None:
        if not isinstance(node, ast.Module):  # inspected (imported) modules already hold their values
            return
        for stmt in node.body:
            if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                    and isinstance(stmt.targets[0], ast.Tuple) and isinstance(stmt.value, ast.Tuple)
                    and len(stmt.targets[0].elts) == len(stmt.value.elts)):
                continue
            for target, value in zip(stmt.targets[0].elts, stmt.value.elts):
                if isinstance(target, ast.Name) and target.id not in mod.members:
                    mod.set_member(target.id, griffe.Attribute(target.id, value=ast.unparse(value),
                                                               lineno=stmt.lineno, endlineno=stmt.end_lineno))
