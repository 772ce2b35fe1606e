// Command promqlnames reads PromQL expressions (a JSON list of strings) on stdin and writes, for each,
// the metric names its selectors name, with Prometheus's own parser (the one promtool and the
// server use): tests/test_monitoring.py checks that every name the alert rules and the dashboard
// query is one the agent's /metrics serves. An expression that does not parse is an error naming it.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"

	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
)

type result struct {
	Expr  string   `json:"expr"`
	Names []string `json:"names"`
	Error string   `json:"error,omitempty"`
}

func names(p parser.Parser, expr string) result {
	out := result{Expr: expr, Names: []string{}}
	node, err := p.ParseExpr(expr)
	if err != nil {
		out.Error = err.Error()
		return out
	}
	seen := map[string]bool{}
	parser.Inspect(node, func(n parser.Node, _ []parser.Node) error {
		vs, ok := n.(*parser.VectorSelector)
		if !ok {
			return nil
		}
		name := vs.Name
		for _, m := range vs.LabelMatchers {
			if name == "" && m.Name == model.MetricNameLabel && m.Type == labels.MatchEqual {
				name = m.Value // {__name__="x"}
			}
		}
		if name == "" {
			out.Error = fmt.Sprintf("a selector without a metric name: %s", vs)
		} else {
			seen[name] = true
		}
		return nil
	})
	for name := range seen {
		out.Names = append(out.Names, name)
	}
	sort.Strings(out.Names)
	return out
}

func main() {
	var exprs []string
	if err := json.NewDecoder(os.Stdin).Decode(&exprs); err != nil {
		fmt.Fprintf(os.Stderr, "promqlnames: stdin is not a JSON list of strings: %v\n", err)
		os.Exit(2)
	}
	p := parser.NewParser(parser.Options{})
	out := make([]result, 0, len(exprs))
	for _, e := range exprs {
		out = append(out, names(p, e))
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fmt.Fprintf(os.Stderr, "promqlnames: %v\n", err)
		os.Exit(1)
	}
}
